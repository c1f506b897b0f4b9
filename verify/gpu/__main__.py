import sys

from .step import main

if __name__ == "__main__":
    sys.exit(main())
