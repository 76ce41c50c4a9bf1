"""The shipped, verified rule set (DESIGN "Rule file").  Never edit by hand: regenerate with
``unity-pcg rules generate``; ``substitutions.cache.load()`` refuses a file whose digest does not match
its manifest."""
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
RULES_PATH = DATA_DIR / "rules.json"
MANIFEST_PATH = DATA_DIR / "manifest.json"
