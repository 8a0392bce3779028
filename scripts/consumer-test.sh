#!/usr/bin/env bash
# The installed epx, used by a project of its own (the ctest consumer_install runs this):
# cmake --install BUILD into WORK/prefix, then tests/consumer built and run twice against it,
# with find_package(epx) + epx::epx and with pkg-config. Only the installed libepx.a is linked;
# nothing of epx is compiled again.
#   bash scripts/consumer-test.sh BUILD [WORK]    (BUILD: a configured and built epx tree)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:?usage: consumer-test.sh BUILD [WORK]}" && pwd)
work=${2:-$build/consumer}
prefix=$work/prefix
rm -rf "$work"
mkdir -p "$work"

cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
cc=$(cache CMAKE_C_COMPILER)
cxx=$(cache CMAKE_CXX_COMPILER)
if [ -n "$(cache EPX_SANITIZE)" ]; then
  echo "consumer-test: $build is a sanitizer build; its libepx.a needs the sanitizer runtime" >&2
  exit 1
fi

echo "== cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log"
sed 's/^/  /' "$work/install.log"
lib=$(find "$prefix" -name libepx.a)
pc=$(find "$prefix" -name epx.pc)
[ -n "$lib" ] && [ -n "$pc" ] && [ -f "$prefix/include/epx/epx.h" ] && [ -f "$prefix/include/epx/epx.hpp" ] ||
  { echo "consumer-test: the install lacks libepx.a, epx.pc or the headers" >&2; exit 1; }
if find "$prefix" -type f -perm -u+x | grep -q .; then
  echo "consumer-test: the install holds executables:" >&2
  find "$prefix" -type f -perm -u+x >&2
  exit 1
fi

echo "== (a) find_package(epx) + epx::epx"
cmake -S "$src/tests/consumer" -B "$work/cmake" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work/cmake.log"
grep 'epx_consumer:' "$work/cmake.log"
found=$(sed -n 's/^epx_DIR:PATH=//p' "$work/cmake/CMakeCache.txt")
case "$found" in
  "$prefix"/*) ;;
  *) echo "consumer-test: find_package(epx) found $found, not the install in $prefix" >&2; exit 1 ;;
esac
cmake --build "$work/cmake"
"$work/cmake/epx_consumer_cpp"
"$work/cmake/epx_consumer_c"

echo "== (b) pkg-config"
export PKG_CONFIG_PATH=$(dirname "$pc")
flags=$(pkg-config --cflags --libs epx)
echo "pkg-config --cflags --libs epx: $flags"
mkdir -p "$work/pkg-config"
# shellcheck disable=SC2086  # the flags are words
"$cxx" -std=c++20 -O2 -Wall -Wextra -Wpedantic -Werror "$src/tests/consumer/main.cpp" -o "$work/pkg-config/epx_consumer_cpp" $flags
# shellcheck disable=SC2086
"$cc" -std=c11 -O2 -Wall -Wextra -Wpedantic -Werror "$src/tests/consumer/main.c" -o "$work/pkg-config/epx_consumer_c" $flags
"$work/pkg-config/epx_consumer_cpp"
"$work/pkg-config/epx_consumer_c"

echo "consumer-test: OK"
