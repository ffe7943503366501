import sys

from cluster.bench.offline import main

sys.exit(main())
