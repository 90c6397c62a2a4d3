"""The application layer under the CLI: data, model sources, evaluation, the run folder, the taper pipeline
and its report. Uses the library (training/, export/) as a user would."""
