import os
import sys

# Unit tests import the tiny in-process models from this folder.
sys.path.insert(0, os.path.dirname(__file__))
