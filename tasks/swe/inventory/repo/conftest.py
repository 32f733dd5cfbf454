# Makes the package importable however pytest is started (pytest puts this folder on sys.path).
