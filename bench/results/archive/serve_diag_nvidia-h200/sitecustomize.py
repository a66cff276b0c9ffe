import os, sys
if os.environ.get("LIK_DIAG_SWITCH"):
    sys.setswitchinterval(float(os.environ["LIK_DIAG_SWITCH"]))
