"""One module per ``monet`` command: its help, its options and the call into the work.

Each imports what does the work only when it runs, so ``monet --help`` stays quick (OR-Tools
and torch take seconds to import).
"""
