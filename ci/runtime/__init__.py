"""What every part of the factory runs inside: errors and exit codes, progress lines, pip's environment, file helpers."""
