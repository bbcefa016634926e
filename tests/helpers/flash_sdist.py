"""flash-attn's Python package, fetched at test time from its source distribution and cached.

Nothing from flash-attn is stored in this repository. ``interface_source(version)`` finds
the release's sdist on the package index (``$PIP_INDEX_URL``, else PyPI's simple index),
downloads it (8.5 MB, a few seconds), checks its pinned sha256, extracts only
``flash_attn/__init__.py`` and ``flash_attn/flash_attn_interface.py``, and caches them under
``$COMPILE_PASS_FLASH_ATTN_CACHE`` (default ``~/.cache/compile_pass/flash-attn``), one folder
per version; later runs read the cache.

Not ``pip download``: for an sdist it prepares metadata by running flash-attn's setup.py,
which imports torch, setuptools and wheel, and a fresh CI environment has no wheel.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

# sha256 of the sdists on PyPI, so a changed or substituted file fails the download.
SDIST_SHA256 = {
    "2.7.4.post1": "f03485c9a49a4d68d0733acdcad80ab0e72afa025a777fdc2966ceccf9d51765",
    "2.8.3": "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d",
}
FILES = ("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py")


def cache_root() -> Path:
    if "COMPILE_PASS_FLASH_ATTN_CACHE" in os.environ:
        return Path(os.environ["COMPILE_PASS_FLASH_ATTN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "compile_pass" / "flash-attn"


def _sdist_url(version: str) -> str:
    """The sdist's address, from the index's PEP 503 page of links."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/flash-attn/"
    with urllib.request.urlopen(index, timeout=60) as response:
        page = response.read().decode()
    name = f"flash_attn-{version}.tar.gz"
    for link in re.findall(r'href="([^"]+)"', page):
        if urllib.parse.urlsplit(link).path.endswith("/" + name):
            return urllib.parse.urljoin(index, link.replace("&amp;", "&"))
    raise RuntimeError(f"{index} lists no {name}")


def _download(version: str, into: Path) -> Path:
    url = _sdist_url(version)
    sdist = into / f"flash_attn-{version}.tar.gz"
    with urllib.request.urlopen(url, timeout=300) as response, open(sdist, "wb") as file:
        shutil.copyfileobj(response, file)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256[version]:
        raise RuntimeError(f"{url}: sha256 {digest}, expected {SDIST_SHA256[version]}")
    return sdist


def interface_source(version: str) -> Path:
    """A folder holding flash-attn ``version``'s ``flash_attn`` package (Python files only)."""
    target = cache_root() / version
    if all((target / name).is_file() for name in FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        try:
            sdist = _download(version, Path(download))
        except OSError as error:  # urllib's errors are OSErrors
            raise RuntimeError(
                f"could not download the flash-attn {version} sdist: {error}. Without network access, "
                f"put {' and '.join(FILES)} of that release under {target}."
            ) from error
        # Extract beside the target and rename into place: concurrent runs never see half a copy.
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{version}-"))
        try:
            with tarfile.open(sdist) as archive:
                for name in FILES:
                    member = archive.extractfile(f"flash_attn-{version}/{name}")
                    (staging / name).parent.mkdir(parents=True, exist_ok=True)
                    (staging / name).write_bytes(member.read())
            os.replace(staging, target)
        except OSError:
            if not all((target / name).is_file() for name in FILES):  # another run won the race
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
