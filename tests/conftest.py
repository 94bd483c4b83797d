import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every pipeline run in the suite checks the passes' contracts (graphmp/passes/__init__.py)
os.environ.setdefault("GRAPHMP_DEBUG", "1")
sys.path.insert(0, ROOT)
