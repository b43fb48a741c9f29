import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench scripts import each other by module name
