# Sourced from the repository's root by check.sh, bench.sh and speed_check.sh: the wheels carried in .whl/
# (fetch_wheels.sh) installed into /tmp/site once a machine (a later script, or a later call on the same warm
# machine, finds them there; remove /tmp/site to install them again), and /tmp/site put on PYTHONPATH.
if [ -d .whl ] && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "$(basename "$0"): installing the carried wheels failed"; rm -rf /tmp/site; exit 1; }
fi
if [ -d /tmp/site ]; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
