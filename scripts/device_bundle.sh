#!/usr/bin/env bash
# Fetches here the wheels of every runtime dependency of meshserve that the device image lacks (the image's packages:
# scripts/device_image.txt), with their own dependencies, for the image's Python 3.12 on x86-64 Linux, into one folder
# (default .device_bundle/, ignored by git) that travels with the working tree to the device machine, where
# scripts/device_accept.sh installs it with no index. Wheels of packages the image has are dropped (the image's own
# versions serve). Prints the bundle's size against the 64 MiB a device call carries.
#
#   scripts/device_bundle.sh [--dry-run] [--dest DIR]
#     --dry-run  print the requirements it would fetch (pyproject's runtime dependencies minus the image's), one per
#                line on stdout, and fetch nothing
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device_bundle
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --dest) DEST="$2"; shift ;;
    --dest=*) DEST="${1#--dest=}" ;;
    *) echo "device_bundle.sh: unknown argument $1 (expected --dry-run, --dest DIR)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
CARRY_LIMIT=$((64 * 1024 * 1024))  # what one device call carries: the working tree and the carried paths together

# The runtime requirements the image does not satisfy by name (pyproject [project].dependencies).
mapfile -t REQS < <("$PY" - <<'EOF'
import re, tomllib
from pathlib import Path
image = {re.sub(r"[-_.]+", "-", l.strip()).lower() for l in Path("scripts/device_image.txt").read_text().splitlines()
         if l.strip() and not l.startswith("#")}
for req in tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]:
    name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", req).group(0)).lower()
    if name not in image:
        print(req)
EOF
)
if [ "$DRY" = 1 ]; then
  printf '%s\n' "${REQS[@]}"
  echo "device_bundle.sh --dry-run: ${#REQS[@]} requirements to fetch with their dependencies (not on the image)" >&2
  exit 0
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download --quiet --dest "$TMP" --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" --platform any "${REQS[@]}"

# Keep the wheels of packages the image lacks; one version of each.
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" - "$TMP" "$DEST" <<'EOF'
import re, shutil, sys
from pathlib import Path
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
image = {re.sub(r"[-_.]+", "-", l.strip()).lower() for l in Path("scripts/device_image.txt").read_text().splitlines()
         if l.strip() and not l.startswith("#")}
kept, dropped = [], []
for whl in sorted(src.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
    if name in image:
        dropped.append(whl.name)
    else:
        shutil.copy2(whl, dest / whl.name)
        kept.append(whl.name)
for w in kept:
    print(f"  bundled  {w}")
for w in dropped:
    print(f"  on image {w} (not bundled)")
EOF
BYTES=$(du -sb "$DEST" | cut -f1)
TREE=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "bundle: $(ls "$DEST" | wc -l) wheels, $((BYTES / 1024)) KiB in $DEST; the tracked tree $((TREE / 1024)) KiB;" \
     "together $(((BYTES + TREE) * 100 / CARRY_LIMIT))% of the 64 MiB a device call carries"
if [ $((BYTES + TREE)) -gt $CARRY_LIMIT ]; then
  echo "device_bundle.sh: over the 64 MiB carry limit: the acceptance run needs none of these (lazy imports)," \
       "so carry less: the structured stage then reports SKIP" >&2
  exit 1
fi
