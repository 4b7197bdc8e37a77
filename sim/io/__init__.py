"""Files, directories and the terminal: safe reads and writes, result directories, YAML errors, progress."""
