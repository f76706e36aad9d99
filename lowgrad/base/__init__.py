"""The basics every layer uses: the exception tree, element types, the integer and timeout
rules, integer limits, NVTX ranges and trace lines, the package version. Imports nothing else of
lowgrad."""
