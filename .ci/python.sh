# Sourced: creates .venv with Python 3.12 (the default python3 may be 3.11) and sets PY to it.
if [ ! -x .venv/bin/python ]; then
    if command -v python3.12 >/dev/null 2>&1 && PYENV_VERSION=3.12 python3.12 -c '' 2>/dev/null; then
        PYENV_VERSION=3.12 python3.12 -m venv .venv
    elif command -v pyenv >/dev/null 2>&1 && [ -x "$(pyenv root)/versions/$(pyenv versions --bare | grep '^3\.12' | tail -1)/bin/python3.12" ]; then
        "$(pyenv root)/versions/$(pyenv versions --bare | grep '^3\.12' | tail -1)/bin/python3.12" -m venv .venv
    else
        echo "Python 3.12 not found (tried python3.12 and pyenv)" >&2
        exit 1
    fi
fi
PY=.venv/bin/python
