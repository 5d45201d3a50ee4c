"""Fetch SIMDe's headers (Debian's libsimde-dev, MIT licensed) into DEST/include for tests/kernels/test_avx512_emulated.py,
which builds the AVX-512 kernels against them to run on CPUs without AVX-512. Test-only: never part of hf_w4's own
build. Pinned by version and sha256; idempotent. Usage: python .ci/fetch_simde.py DEST"""
import hashlib
import io
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request

URL = "http://deb.debian.org/debian/pool/main/s/simde/libsimde-dev_0.7.4~rc2-2_all.deb"
SHA256 = "471b66fdc79e0a479c4d11dc85c2b6313df1704b737ea2f7266753335c5d062b"


def ar_members(data: bytes):
    """(name, bytes) of a Unix ar archive (the .deb container)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    i = 8
    while i + 60 <= len(data):
        name, size = data[i:i + 16].decode().strip().rstrip("/"), int(data[i + 48:i + 58].decode().strip())
        yield name, data[i + 60:i + 60 + size]
        i += 60 + size + (size & 1)


def main(dest: str) -> None:
    inc = os.path.join(dest, "include")
    if os.path.exists(os.path.join(inc, "simde", "x86", "avx512.h")):
        return
    deb = urllib.request.urlopen(URL, timeout=60).read()
    got = hashlib.sha256(deb).hexdigest()
    if got != SHA256:
        raise SystemExit(f"{URL}: sha256 {got}, expected {SHA256}")
    data = dict(ar_members(deb))["data.tar.xz"]
    os.makedirs(dest, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=dest)
    try:
        with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("./usr/include/simde/") and m.isfile()]
            tar.extractall(tmp, members=members, filter="data")
        shutil.rmtree(inc, ignore_errors=True)
        os.replace(os.path.join(tmp, "usr", "include"), inc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/simde")
