import sys
from pathlib import Path

# tests/harness.py is imported as `harness` by the test modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
