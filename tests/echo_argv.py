"""Test helper run inside a container: prints its argv (after the script name) as JSON."""

import json
import sys

sys.stdout.write(json.dumps(sys.argv[1:]) + "\n")
