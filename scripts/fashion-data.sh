#!/usr/bin/env bash
# fashion-data.sh BIN_DIR [DIR] — prints the Fashion-MNIST dataset directory, converting the
# Debian package's IDX files into LMDB shards on first use (about half a second).
set -eu
BIN=${1:?usage: fashion-data.sh BIN_DIR [DIR]}
DIR=${2:-data/fashion-mnist}
if [ ! -f "$DIR/train/classes.txt" ] || [ ! -f "$DIR/test/classes.txt" ]; then
  echo "converting Fashion-MNIST into $DIR (first use)" >&2
  "$BIN/zps-data" convert fashion-mnist --out "$DIR" --force >&2
fi
echo "$DIR"
