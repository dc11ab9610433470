# Sourced by the device scripts, which run ep_comm from its source tree without installing it.
# The wheel installs the three source folders as one package (pyproject.toml's package table:
# ep_comm/, collectives/ as ep_comm.collectives, topology/ as ep_comm.topology); this lays the
# tree out the same way with links under build/tree and puts it on PYTHONPATH, with tests/ and
# examples/ (their helpers and the example model).
_tree="$PWD/build/tree"
rm -rf "$_tree" && mkdir -p "$_tree/ep_comm"
ln -s "$PWD"/ep_comm/* "$_tree/ep_comm/"
ln -s "$PWD/collectives" "$PWD/topology" "$_tree/ep_comm/"
export PYTHONPATH="$_tree:$PWD/tests:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"
# and not the working directory (python -c, python -m put it first on sys.path), where ep_comm/
# is the bare source folder, without its subpackages
export PYTHONSAFEPATH=1
unset _tree
