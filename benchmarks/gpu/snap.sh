#!/usr/bin/env bash
# Make the GPU round's snapshot HERE (never in the device command: round 18 lost a call to an archive made on the
# device from its stale copy): .snap/ = `git archive HEAD`, plus .snap/SNAP_COMMIT (the commit it was made from), which
# run_round.sh takes as LINATTN_COMMIT and checks against a LINATTN_COMMIT given by hand. Usage, from the repository
# root: bash benchmarks/gpu/snap.sh [--fla]   (--fla: copy .whl_fla/ into the snapshot, for steps that time FLA)
set -eu
rm -rf .snap && mkdir .snap
git archive HEAD | tar -x -C .snap
git rev-parse --short HEAD > .snap/SNAP_COMMIT
if [ "${1:-}" = "--fla" ]; then cp -r .whl_fla .snap/; fi
echo "snapshot of $(cat .snap/SNAP_COMMIT) in .snap$( [ -n "$(git status --porcelain --untracked-files=no)" ] && echo ' (the tree has uncommitted changes: not in the snapshot)')"
