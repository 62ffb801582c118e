"""The platform around the runtime: the job store (SQLite) that records every run, and the views the
CLI (and, next, the dashboard and its HTTP API) read from it.

Nothing here runs training: the launcher (:mod:`psflow.launch`) writes runs into the job store
through the run-store interface; readers open the store and never own a run, so a run survives any
reader going down. Importing this package does nothing; import its modules.
"""
