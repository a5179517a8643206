"""The recording library the training steps' repeat-path tests share
(test_autograd_step.py, test_varlen_step.py): no GPU, no kernels."""


class RecordingLibrary:
    """launch_again and the step's launches, recorded: ``repeat`` says whether a kept
    launch is found. The tensors a launch is given that the step made (outputs, gradients,
    workspaces) are kept alive, so that no input of a later call takes their addresses."""

    def __init__(self):
        self.asked, self.launches, self.made, self.repeat = [], [], [], False

    def launch_again(self, key):
        self.asked.append(key)
        return self.repeat

    def launch(self, kind, made, keys):
        """A checked launch of ``kind`` given the tensors ``made``, kept under ``keys``."""
        self.launches.append((kind, tuple(keys)))
        self.made += [t for t in made if t is not None]

    def masked(self, key):
        """``key`` without the addresses of what the steps made: what a call's own arguments
        and options put in it."""
        made = {t.data_ptr() for t in self.made}
        return tuple(x for x in key if not (type(x) is int and x in made))


def assert_keys_apart(keys: dict, same_forward: set) -> None:
    """``keys``: name -> (forward key, backward key) of calls that differ in one thing each.
    Every backward key is its own; so is every forward key but those of ``same_forward``
    (calls that differ only in what the backward alone reads), which are one; no forward key
    is a backward's."""
    forward = {name: fwd for name, (fwd, _) in keys.items()}
    backward = {name: bwd for name, (_, bwd) in keys.items()}
    assert len(set(forward.values())) == len(forward) - len(same_forward) + 1
    assert len({forward[name] for name in same_forward}) == 1
    assert len(set(backward.values())) == len(backward)
    assert not set(forward.values()) & set(backward.values())
