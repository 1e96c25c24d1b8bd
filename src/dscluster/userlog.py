"""`from dscluster import userlog` and `python -m dscluster.userlog --exports`: the names users'
scripts and entry_cn.sh use. The API lives in dscluster.rundir.userlog (the run directory's
package); this module only hands it on."""

import sys

from dscluster.rundir.userlog import LAUNCHER_ENV, RUN_DIR_ENV, UserRun, main, open_run, program_exports, run_dir  # noqa: F401  (re-exported)

if __name__ == "__main__":
    sys.exit(main())
