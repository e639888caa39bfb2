import sys

from hypic.train.loop import main

sys.exit(main())
