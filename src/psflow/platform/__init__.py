"""The platform around the runtime: the job store (SQLite) that records every run, the views the CLI
reads from it, the control requests (stop, dump) that reach a run's launcher through it, and
``psflow ui``: the HTTP API, Prometheus metrics and the dashboard page over it.

Nothing here runs training: the launcher (:mod:`psflow.launch`) writes runs into the job store
through the run-store interface and takes the control requests from it; readers open the store and
never own a run, so a run survives any reader, the dashboard included, going down. The runs the API
starts are launcher processes of their own (:mod:`psflow.platform.launching`). Importing this
package does nothing; import its modules.
"""
