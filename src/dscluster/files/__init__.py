"""The files dscluster writes and reads back: atomic writes, typed file models, the state directory
and its env files, paths, checkout manifests and redaction of secrets."""
