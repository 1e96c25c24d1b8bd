"""The run directory: the one interface between training and analysis (docs/run-directory.md).

- layout.py: the run id, where a run directory is, and every file and folder name in it;
- writer.py: this rank's writer (metrics/rank-R.jsonl, env/rank-R.json, summary.json through the
  one secret rule) and summary.json's typed record (RunRecord);
- userlog.py: the API a user's own script logs through (`from dscluster import userlog` hands it on).
Analysis only reads what these write.
"""
