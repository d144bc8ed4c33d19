#!/bin/bash
# Stage the bench for the GPU device machine (no network there).
# Usage: bench/stage_gpu.sh DEST   (DEST: a git-ignored folder of the checkout the
# device tool sends, e.g. /work/main/.gpu-wt-bench; the tool only carries from there).
# Needs ../shared/gpu/stage-wheels.sh's output in .gpu/a and .gpu/b (mlx CUDA wheels)
# and the peer's wheels in .gpu/peer. Then, on the device:
#   call 1: carry [DEST/a]  bash DEST/a/install.sh
#   call 2: carry [DEST/b]  bash DEST/b/install.sh && cd /tmp/wt && \
#           PYTHONPATH=/tmp/site:/tmp/wt python3 -m bench ...
set -euo pipefail
dest=$1
root=$(git rev-parse --show-toplevel)
cd "$root"
rm -rf "$dest" && mkdir -p "$dest/a" "$dest/b"
cp .gpu/a/*.whl .gpu/a/part.aa .gpu/a/cuda-wheel-name "$dest/a/"
cp .gpu/b/part.ab "$dest/b/"
cp .gpu/peer/*.whl "$dest/b/"
# Our code as it is in this worktree, generated stubs included (git ignores them).
tar czf "$dest/b/tree.tgz" --exclude=__pycache__ bench smg_mlx
name=$(basename "$dest")
cat > "$dest/a/install.sh" <<EOS
#!/bin/bash
# Keep the first half of the CUDA wheel and the small wheels until call 2.
set -e
mkdir -p /tmp/gpu-stage && cp $name/a/* /tmp/gpu-stage/ && echo "staged \$(ls /tmp/gpu-stage | wc -l) files"
EOS
cat > "$dest/b/install.sh" <<EOS
#!/bin/bash
# Join the CUDA wheel; install mlx & co into /tmp/site, the peer's packages into
# /tmp/peer-site (its mlx-lm 0.31 shadows ours there), our tree into /tmp/wt.
set -e
here=\$PWD/$name/b
if [ ! -f /tmp/site/.done ]; then
  [ -f /tmp/gpu-stage/part.aa ] || { echo "run a/install.sh first (the machine went back?)"; exit 1; }
  cat /tmp/gpu-stage/part.aa \$here/part.ab > /tmp/gpu-stage/\$(cat /tmp/gpu-stage/cuda-wheel-name)
  rm /tmp/gpu-stage/part.aa
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/gpu-stage/*.whl
  touch /tmp/site/.done
fi
if [ ! -f /tmp/peer-site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer-site \$here/*.whl
  touch /tmp/peer-site/.done
fi
printf '#!/bin/bash\nPYTHONPATH=/tmp/peer-site:/tmp/site exec python3 "\$@"\n' > /tmp/peer-python
chmod +x /tmp/peer-python
rm -rf /tmp/wt && mkdir -p /tmp/wt && tar xzf \$here/tree.tgz -C /tmp/wt
echo "installed: /tmp/site, /tmp/peer-site, /tmp/wt"
EOS
du -sh "$dest/a" "$dest/b"
