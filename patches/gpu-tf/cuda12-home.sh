#!/bin/bash
# A CUDA 12.4 home for the TensorFlow GPU line (make install GPU=tf; docs/gpus.rst).
#
# TensorFlow 2.21 is built for CUDA 12, and PyPI's CUDA 12 compiler wheel has no nvcc, so
# the compiler, headers and runtime come from Debian 13's non-free section: downloaded
# through an apt source list of this script's own and unpacked, never installed (Debian's
# packages would bring Debian 13's C library and compilers with them). CUDA 12.4's C++
# library headers (nv/target, cub, thrust) come from PyPI's wheel of the same release.
#
# Usage: cuda12-home.sh DEST PYTHON. DEST then holds bin/nvcc, include/, lib64/ and nvvm/ in
# CUDA's own layout (CUDA_HOME); nothing else on the machine changes.
set -euo pipefail
if [ $# -ne 2 ]; then
	echo "usage: $0 DEST PYTHON" >&2
	exit 2
fi
dest=$1
python=$2
fail() {
	echo "cuda12-home.sh: $*; docs/gpus.rst says what the TensorFlow GPU line needs" >&2
	exit 1
}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
for need in apt-get dpkg-deb "$keyring"; do
	if ! command -v "$need" >/dev/null && [ ! -f "$need" ]; then
		fail "$need is missing: CUDA 12.4's compiler comes from Debian's archive, with" \
			"apt-get, dpkg-deb and Debian's archive keys (the package debian-archive-keyring)"
	fi
done
arch=$(dpkg --print-architecture)
[ "$arch" = amd64 ] || fail "this machine is $arch: the line is built for x86-64 (amd64) only"
# CUDA's own releases; Debian's revision of them (after the last "-") may move on.
toolkit=12.4.131~12.4.1
runtime=12.4.127~12.4.1
work=$dest.partial
rm -rf "$work" "$dest"
mkdir -p "$work/apt/lists/partial" "$work/debs" "$work/root" "$work/cccl"
echo "deb [signed-by=$keyring] http://deb.debian.org/debian trixie non-free" \
	>"$work/apt/sources.list"
# Its own lists and cache; it fetches as the user running it (its sandbox user could not
# write to the folder).
apt=(-qq -o Dir::Etc::sourcelist="$work/apt/sources.list" -o Dir::Etc::sourceparts=/nonexistent
	-o Dir::State::Lists="$work/apt/lists" -o Dir::Cache="$work/apt/cache"
	-o APT::Sandbox::User="$(id -un)")
apt-get "${apt[@]}" update
(cd "$work/debs" && apt-get "${apt[@]}" download nvidia-cuda-toolkit libnvvm4 libcudart12 \
	nvidia-cuda-dev)
for package in nvidia-cuda-toolkit:$toolkit libnvvm4:$toolkit libcudart12:$runtime \
	nvidia-cuda-dev:$runtime; do
	version=$(dpkg-deb -f "$work"/debs/"${package%%:*}"_*.deb Version)
	case $version in
	"${package#*:}"-*) ;;
	*) fail "Debian's ${package%%:*} is $version now, not CUDA ${package#*:}" ;;
	esac
done
for deb in "$work"/debs/{nvidia-cuda-toolkit,libnvvm4,libcudart12}_*.deb; do
	dpkg-deb -x "$deb" "$work/root"
done
# Of the development package (930 MB, every CUDA library's), only the headers and the two
# static libraries that nvcc links into every program.
dpkg-deb --fsys-tarfile "$work"/debs/nvidia-cuda-dev_*.deb | tar -x -C "$work/root" \
	./usr/include ./usr/lib/x86_64-linux-gnu/libcudart_static.a \
	./usr/lib/x86_64-linux-gnu/libcudadevrt.a
"$python" -m pip download --quiet --no-deps -d "$work/cccl" nvidia-cuda-cccl-cu12==12.4.127.post1
"$python" -m zipfile -e "$work"/cccl/*.whl "$work/cccl"

home=$work/cuda
usr=$work/root/usr
mkdir -p "$home/bin/crt" "$home/nvvm/bin" "$home/nvvm/lib64" "$home/lib64"
cp "$usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$home/bin/"
cp "$usr"/bin/{cudafe++,fatbinary,nvlink,ptxas,bin2c} "$home/bin/"
cp "$usr"/lib/nvidia-cuda-toolkit/bin/crt/*.stub "$home/bin/crt/"
cp "$usr/lib/nvidia-cuda-toolkit/bin/cicc" "$home/nvvm/bin/"
cp -r "$usr/lib/nvidia-cuda-toolkit/libdevice" "$home/nvvm/libdevice"
cp -P "$usr"/lib/x86_64-linux-gnu/libnvvm.so* "$home/nvvm/lib64/"
cp -r "$usr/include" "$home/include"
cp -r "$work"/cccl/nvidia/cuda_cccl/include/* "$home/include/"
cp -P "$usr"/lib/x86_64-linux-gnu/libcudart* "$usr"/lib/x86_64-linux-gnu/libcudadevrt.a \
	"$home/lib64/"
ln -sf libcudart.so.12 "$home/lib64/libcudart.so"
# nvcc reads its folders from the profile beside it; Debian's names /usr, this one its home.
cat >"$home/bin/nvcc.profile" <<'EOF'
TOP = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES =+ $(_SPACE_) "-L$(TOP)/lib64"
CUDAFE_FLAGS +=
PTXAS_FLAGS +=
EOF
"$home/bin/nvcc" --version | tail -2
mv "$home" "$dest"
rm -rf "$work"
