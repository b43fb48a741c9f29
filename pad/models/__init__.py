"""Models: which weights the default pair loads, where from, and the shipped classifiers."""
