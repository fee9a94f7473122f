#!/usr/bin/env bash
# wlb data prepare end to end: a small corpus from /usr/share/common-licenses (always on
# Debian) -> Megatron .bin/.idx; decoded back byte for byte, split by the documented path
# hash, deterministic, readable by `wlb data stats` / `wlb plan`; bad input exits 2.
set -u
WLB="$1"; SRC="$2"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
PY=/usr/bin/python3

# Corpus: regular files in two levels, an empty file (skipped), a symbolic link (skipped).
C="$T/corpus"; mkdir -p "$C/sub/deeper"
for f in Apache-2.0 BSD GPL-2 GPL-3 LGPL-2.1 LGPL-3 MPL-2.0 CC0-1.0 Artistic GFDL-1.3; do
  [ -e "/usr/share/common-licenses/$f" ] && cp -L "/usr/share/common-licenses/$f" "$C/$f"
done
[ "$(ls "$C" | wc -l)" -ge 5 ] || fail "fewer than 5 licence files in /usr/share/common-licenses"
mv "$C/BSD" "$C/sub/BSD"; mv "$C/Artistic" "$C/sub/deeper/Artistic" 2>/dev/null || true
printf 'short\n' > "$C/sub/tiny.txt"
: > "$C/empty.txt"
ln -s GPL-3 "$C/link-to-gpl"

# The decode check: every regular non-empty file appears once, in sorted path order, in the
# split the documented hash picks; pieces of at most MAX bytes when MAX > 0; with a fifth
# argument SEED, every piece in the order of the documented shuffle key.
cat > "$T/check.py" <<'PYEOF'
import os, sys
import numpy as np
corpus, prefix, frac, maxb = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else None
M64 = (1 << 64) - 1
def fin(h):
    h = ((h ^ (h >> 30)) * 0xbf58476d1ce4e5b9) & M64
    h = ((h ^ (h >> 27)) * 0x94d049bb133111eb) & M64
    return h ^ (h >> 31)
def doc_hash(path):
    h = 0xcbf29ce484222325
    for b in path.encode():
        h = ((h ^ b) * 0x100000001b3) & M64
    return fin(h)
def shuffle_key(path, piece):
    return fin((doc_hash(path) + 0x9e3779b97f4a7c15 * (seed + 1) + 0xd1b54a32d192ed03 * piece) & M64)
def read_split(p):
    idx = open(p + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "magic"
    assert int.from_bytes(idx[9:17], "little") == 1, "version"
    assert idx[17] == 8, "dtype code (uint16)"
    nseq = int.from_bytes(idx[18:26], "little"); ndoc = int.from_bytes(idx[26:34], "little")
    o = 34
    sizes = np.frombuffer(idx, np.int32, nseq, o); o += 4 * nseq
    ptrs = np.frombuffer(idx, np.int64, nseq, o); o += 8 * nseq
    doc_idx = np.frombuffer(idx, np.int64, ndoc, o); o += 8 * ndoc
    assert o == len(idx), "trailing bytes in .idx"
    assert doc_idx[0] == 0 and doc_idx[-1] == nseq
    tok = np.fromfile(p + ".bin", np.uint16)
    assert tok.size == sizes.sum(), ".bin size"
    assert tok.max(initial=0) < 256, "byte tokens"
    docs = []
    for d in range(ndoc - 1):
        b = b"".join(tok[ptrs[s] // 2: ptrs[s] // 2 + sizes[s]].astype(np.uint8).tobytes()
                     for s in range(doc_idx[d], doc_idx[d + 1]))
        docs.append(b)
    return docs
files = []
for root, dirs, names in os.walk(corpus):
    for n in names:
        full = os.path.join(root, n)
        if os.path.islink(full) or not os.path.isfile(full) or os.path.getsize(full) == 0:
            continue
        files.append(os.path.relpath(full, corpus).replace(os.sep, "/"))
files.sort(key=lambda s: s.encode())
want = {"train": [], "valid": []}
for f in files:
    data = open(os.path.join(corpus, f), "rb").read()
    pieces = [data[i:i + maxb] for i in range(0, len(data), maxb)] if maxb > 0 else [data]
    split = "valid" if (doc_hash(f) >> 11) * 2.0 ** -53 < frac else "train"
    want[split] += [(shuffle_key(f, k) if seed is not None else 0, p) for k, p in enumerate(pieces)]
for split in want:  # a stable sort: path order without a seed
    want[split] = [p for _, p in sorted(want[split], key=lambda kp: kp[0])]
for split in ("train", "valid"):
    got = read_split(prefix + "_" + split)
    assert len(got) == len(want[split]), f"{split}: {len(got)} documents, expected {len(want[split])}"
    for i, (g, w) in enumerate(zip(got, want[split])):
        assert g == w, f"{split} document {i} differs from its file"
print(f"ok {len(files)} files, train {len(want['train'])} docs, valid {len(want['valid'])} docs")
PYEOF

"$WLB" data prepare "$C" --out "$T/ds" --valid-fraction 0.3 > "$T/out.txt" 2> "$T/err.txt" \
  || { cat "$T/out.txt" "$T/err.txt"; fail "prepare"; }
for f in ds_train.bin ds_train.idx ds_valid.bin ds_valid.idx; do [ -s "$T/$f" ] || fail "no $f"; done
grep -q "^train " "$T/out.txt" && grep -q "^valid " "$T/out.txt" || { cat "$T/out.txt"; fail "counts table"; }
grep -q "(1 shorter than --min-bytes 1 skipped), 1 symbolic" "$T/out.txt" || { cat "$T/out.txt"; fail "skip counts"; }
$PY "$T/check.py" "$C" "$T/ds" 0.3 0 || fail "decode check"
# train + valid document counts printed = files kept
n_files=$(find "$C" -type f -size +0 | wc -l)
n_docs=$(awk '$1=="train"||$1=="valid"{s+=$3} END{print s}' "$T/out.txt")
[ "$n_docs" -eq "$n_files" ] || fail "printed documents $n_docs != files $n_files"
ls "$T" | grep -q tmp && fail "temporary files left behind"

# Deterministic: a re-run gives byte-identical files; the output inside the source tree is
# not read back as a document.
"$WLB" data prepare "$C" --out "$T/again" --valid-fraction 0.3 > /dev/null 2>&1 || fail "re-run"
for s in train valid; do for e in bin idx; do
  cmp -s "$T/ds_$s.$e" "$T/again_$s.$e" || fail "re-run differs: $s.$e"
done; done
"$WLB" data prepare "$C" --out "$C/inside" --valid-fraction 0.3 > /dev/null 2>&1 || fail "output inside source"
"$WLB" data prepare "$C" --out "$C/inside" --valid-fraction 0.3 > /dev/null 2>&1 || fail "output inside source, again"
for s in train valid; do for e in bin idx; do
  cmp -s "$T/ds_$s.$e" "$C/inside_$s.$e" || fail "own outputs were read as documents ($s.$e)"
done; done
# ... nor are an earlier run's outputs under another prefix: token datasets, skipped and counted
"$WLB" data prepare "$C" --out "$C/other" --valid-fraction 0.3 > "$T/other.txt" 2>&1 || fail "second prefix inside source"
grep -q ", 4 files of token datasets (.idx/.bin) skipped" "$T/other.txt" || fail "datasets not skipped: $(cat "$T/other.txt")"
for s in train valid; do for e in bin idx; do
  cmp -s "$T/ds_$s.$e" "$C/other_$s.$e" || fail "another run's outputs were read as documents ($s.$e)"
done; done
rm -f "$C"/inside_* "$C"/other_*

# --max-bytes splits long files into consecutive documents; --min-bytes skips short ones.
"$WLB" data prepare "$C" --out "$T/cut" --valid-fraction 0.3 --max-bytes 4000 > "$T/cut.txt" 2>&1 \
  || { cat "$T/cut.txt"; fail "prepare --max-bytes"; }
$PY "$T/check.py" "$C" "$T/cut" 0.3 4000 || fail "decode check --max-bytes"
"$WLB" data prepare "$C" --out "$T/min" --min-bytes 100 > "$T/min.txt" 2>&1 || fail "prepare --min-bytes"
grep -q "(2 shorter than --min-bytes 100 skipped)" "$T/min.txt" || { cat "$T/min.txt"; fail "--min-bytes count"; }
# --max-file-bytes skips longer files: only sub/tiny.txt (6 bytes) is under 100
n_big=$(find "$C" -type f -size +100c | wc -l)
"$WLB" data prepare "$C" --out "$T/small" --max-file-bytes 100 > "$T/small.txt" 2>&1 || fail "prepare --max-file-bytes"
grep -q ", $n_big longer than --max-file-bytes 100 skipped)" "$T/small.txt" || { cat "$T/small.txt"; fail "--max-file-bytes count"; }
[ "$(awk '$1=="train"{print $3 " " $4}' "$T/small.txt")" = "1 6" ] || { cat "$T/small.txt"; fail "--max-file-bytes kept other files"; }

# --shuffle SEED: every document (pieces of cut files included) in the order of the
# documented key; the same documents as path order, another order for another seed.
"$WLB" data prepare "$C" --out "$T/sh7" --valid-fraction 0.3 --max-bytes 4000 --shuffle 7 > "$T/sh.txt" 2>&1 \
  || { cat "$T/sh.txt"; fail "prepare --shuffle"; }
grep -q "order shuffled (seed 7)" "$T/sh.txt" || { cat "$T/sh.txt"; fail "--shuffle not reported"; }
$PY "$T/check.py" "$C" "$T/sh7" 0.3 4000 7 || fail "decode check --shuffle 7"
"$WLB" data prepare "$C" --out "$T/sh8" --valid-fraction 0.3 --max-bytes 4000 --shuffle 8 > /dev/null 2>&1 \
  || fail "prepare --shuffle 8"
$PY "$T/check.py" "$C" "$T/sh8" 0.3 4000 8 || fail "decode check --shuffle 8"
cmp -s "$T/sh7_train.bin" "$T/sh8_train.bin" && fail "--shuffle 7 and 8 gave the same order"
cmp -s "$T/sh7_train.bin" "$T/cut_train.bin" && fail "--shuffle 7 gave path order"

# Tarballs (system tar): same documents as the directory, no unpacked files left in TMPDIR.
mkdir -p "$T/tmp"
tar -cJf "$T/corpus.tar.xz" -C "$C" . || fail "tar -cJ"
TMPDIR="$T/tmp" "$WLB" data prepare "$T/corpus.tar.xz" --out "$T/tx" --valid-fraction 0.3 > /dev/null 2>&1 \
  || fail "prepare .tar.xz"
for s in train valid; do for e in bin idx; do
  cmp -s "$T/ds_$s.$e" "$T/tx_$s.$e" || fail "tarball differs from directory ($s.$e)"
done; done
# Only wlb's own directory counts: an OpenMPI singleton leaves its session directory
# (ompi.HOST.UID/pid.N) in TMPDIR on some machines.
! ls -d "$T/tmp"/wlb-prepare-* > /dev/null 2>&1 || fail "unpacked tarball left in TMPDIR"

# --out in a directory that does not exist yet: made (one that cannot be: below).
"$WLB" data prepare "$C" --out "$T/new/deeper/ds" --valid-fraction 0.3 > /dev/null 2>&1 || fail "--out in a new directory"
cmp -s "$T/ds_train.bin" "$T/new/deeper/ds_train.bin" || fail "--out in a new directory: other tokens"

# The project's reader takes the output: wlb data stats and wlb plan on a megatron deck.
cat > "$T/deck.toml" <<'TOML'
[data]
source = "megatron"
path = "ds_train.idx"
context_window = 4096

[mesh]
dp = 2

[packing]
strategy = "wlb"
micro_batches = 2
TOML
"$WLB" data stats "$T/deck.toml" > "$T/stats.txt" 2>&1 || { cat "$T/stats.txt"; fail "data stats on the output"; }
train_docs=$(awk '$1=="train"{print $3}' "$T/out.txt"); train_tok=$(awk '$1=="train"{print $4}' "$T/out.txt")
grep -q "documents $train_docs  tokens $train_tok " "$T/stats.txt" || { cat "$T/stats.txt"; fail "stats counts"; }
"$WLB" plan "$T/deck.toml" --packer all --steps 3 --check > "$T/plan.txt" 2>&1 || { cat "$T/plan.txt"; fail "plan"; }
[ "$(grep -c ': OK — lost 0 tokens' "$T/plan.txt")" -eq 6 ] || { cat "$T/plan.txt"; fail "plan --check"; }

# Bad input: exit 2 with a message naming the path; nothing written.
expect2() {  # expect2 WHAT PATTERN ARGS...
  local what="$1" pat="$2"; shift 2
  "$WLB" data prepare "$@" > "$T/bad.txt" 2>&1; local rc=$?
  [ $rc -eq 2 ] || { cat "$T/bad.txt"; fail "$what: exit $rc, expected 2"; }
  grep -q -- "$pat" "$T/bad.txt" || { cat "$T/bad.txt"; fail "$what: message lacks '$pat'"; }
}
expect2 "missing source" "nope: source not found" "$T/nope" --out "$T/x"
touch "$T/afile"
expect2 "output under a file" "--out: cannot create the directory $T/afile" "$C" --out "$T/afile/x"
mkdir -p "$T/emptydir/sub"; : > "$T/emptydir/sub/zero"
expect2 "no documents" "emptydir: no documents" "$T/emptydir" --out "$T/x"
expect2 "no documents, into new folders" "emptydir: no documents" "$T/emptydir" --out "$T/fresh/deeper/x"
[ ! -e "$T/fresh" ] || fail "a failed preparation left the folders it made"
expect2 "valid fraction" "valid-fraction" "$C" --out "$T/x" --valid-fraction 1.5
printf 'not a tar\n' > "$T/junk.tar"
expect2 "not a tarball" "junk.tar: .tar -x. failed" "$T/junk.tar" --out "$T/x"
expect2 "plain file" "not a directory or a .tar" "$C/GPL-3" --out "$T/x"
expect2 "missing --out" "out" "$C"
mkdir -p "$T/o12/x_valid.bin"
expect2 "a folder under an output's name" "--out '$T/o12/x_valid.bin': is a directory" "$C" --out "$T/o12/x"
[ "$(ls "$T/o12")" = "x_valid.bin" ] || fail "a refused preparation wrote $(ls "$T/o12")"
expect2 "seed past 2^64" "must be an integer in \[0, 18446744073709551615\]" "$C" --out "$T/x" --shuffle 99999999999999999999999
ls "$T" | grep -q '^x_' && fail "bad input left outputs"
# Ctrl-C mid-scan: neither temporaries nor the folders the run made are left (20 of them:
# more than the handler's table once held).
big="$T/big"; mkdir -p "$big"
yes "a line of words to tokenize, again and again" | head -c 200000000 > "$big/one.txt"
deep="$T/int"; for i in $(seq 19); do deep="$deep/d$i"; done
"$WLB" data prepare "$big" --out "$deep/x" > /dev/null 2>&1 &
ppid=$!
for _ in $(seq 100); do ls "$deep"/x_train.bin.tmp > /dev/null 2>&1 && break; sleep 0.05; done
kill -INT $ppid; wait $ppid; rc=$?
[ $rc -eq 130 ] || fail "an interrupted preparation: exit $rc, expected 130 (it finished first?)"
rm -rf "$big"
[ -e "$T/int" ] && fail "an interrupted preparation left $(find "$T/int")"
# data stats without a deck reads the source the overrides name; an unknown key is an error.
"$WLB" data stats --set 'data.source="megatron"' --set "data.path=\"$T/sh7_train.idx\"" > "$T/st.txt" 2>&1 \
  || { cat "$T/st.txt"; fail "data stats --set without a deck"; }
grep -q "megatron:" "$T/st.txt" || { cat "$T/st.txt"; fail "data stats ignored --set"; }
"$WLB" data stats --set data.bogus=1 > "$T/st.txt" 2>&1 && fail "data stats took an unknown key"
grep -q "unknown key 'bogus'" "$T/st.txt" || { cat "$T/st.txt"; fail "data stats --set message"; }
# A bad length is shown cut short, not as the whole line.
{ echo 12; head -c 3000 /dev/zero | tr '\0' 'x'; echo; } > "$T/longline.txt"
"$WLB" data stats --set 'data.source="text"' --set "data.path=\"$T/longline.txt\"" > "$T/st.txt" 2>&1 && fail "a bad length line"
grep -q "longline.txt:2: .*xxx\.\.\. (3000 bytes)" "$T/st.txt" && [ "$(wc -c < "$T/st.txt")" -lt 400 ] \
  || { head -c 500 "$T/st.txt"; fail "the bad line is not cut short"; }
echo "PASS"
