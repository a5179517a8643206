#!/bin/bash
# What the ncu scripts of this folder share (sourced, not run):
#   ncu_profile REP KERNELS SECTIONS -- CMD ...   one report REP.ncu-rep of the kernels whose
#       names match the regex KERNELS (NCU_LAUNCH: ncu's launch selection, default the third
#       launch), with the space-separated SECTIONS, while CMD runs (its output to REP.log);
#       prints and returns ncu's status
#   ncu_export REP SUMMARY [SOURCES]   from REP.ncu-rep: the details page as CSV
#       (REP-details.csv) and its lines matching the regex SUMMARY (spaces squeezed); for
#       each regex of the space-separated SOURCES the SASS source page of the kernels it
#       matches as CSV (REP-sass-N.csv, N counting from 0); then the report removed
ncu_profile() {
  local rep=$1 kernels=$2 sections=() s
  for s in $3; do sections+=(--section "$s"); done
  shift 4
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:"$kernels" ${NCU_LAUNCH:---launch-skip 2 --launch-count 1} \
    "${sections[@]}" -o "$rep" "$@" > "$rep.log" 2>&1
  local rc=$?
  echo "ncu $(basename "$rep") rc=$rc"
  return $rc
}

ncu_export() {
  local rep=$1 summary=$2 source=${3:-}
  [ -f "$rep.ncu-rep" ] || { echo "no report $rep.ncu-rep"; tail -5 "$rep.log"; return 1; }
  ncu --import "$rep.ncu-rep" --page details --csv > "$rep-details.csv" 2>&1
  ncu --import "$rep.ncu-rep" --page details | grep -E "$summary" | tr -s ' ' | cut -c1-160
  local n=0 k
  for k in $source; do
    ncu --import "$rep.ncu-rep" -k regex:"$k" --page source --print-source sass --csv > "$rep-sass-$n.csv" 2>&1
    n=$((n + 1))
  done
  rm -f "$rep.ncu-rep"
}
