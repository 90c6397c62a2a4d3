"""The application under the ``hf-tapernorm`` command: the checks, the run folder, the taper run (train,
fold, export) and its record and report. It uses the library (data/, training/, export/, evaluation/) as a
user would, and is not part of the API."""
