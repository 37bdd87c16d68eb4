"""``python -m attnkit._backends.native``: the build command under its old name (see
:mod:`attnkit.kernel`, ``attnkit build-kernel``)."""

import sys

from ...kernel import main

if __name__ == "__main__":
    sys.exit(main())
