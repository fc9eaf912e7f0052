"""What every part of the factory runs inside: the process environment, errors and exit codes, progress lines, pip's environment, file helpers."""
