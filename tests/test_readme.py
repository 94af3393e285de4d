"""The README holds what a reader needs and points only at things that exist: at most 200 lines, every image and
every results file it names present in the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_fits_in_200_lines():
    assert len(README.splitlines()) <= 200


def test_every_image_the_readme_shows_exists():
    images = re.findall(r'<img src="([^"]+)"', README) + re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert images, "the README shows the chapter previews"
    assert [i for i in images if not (ROOT / i).is_file()] == []


def test_every_results_file_the_readme_cites_exists():
    cited = set(re.findall(r"`(20\d\d-\d\d-\d\d_[\w.\-]+\.(?:json|txt))`", README))
    assert cited, "the results table cites its JSON files"
    missing = sorted(c for c in cited if not (ROOT / "benchmarks" / "results" / c).is_file())
    assert missing == []
