"""A repository's environment: planned and fetched on the host, built and verified in a container, listed and pruned.

    pyenv.py      what its Python files declare (read on the host, no code run)
    testneeds.py  what its tests need and the command that runs them (CI, tox, nox, pytest configuration)
    releases.py   the release date it resolves at, and the package sources that honour it
    nodeenv.py    a `package.json` repository's Node side: planned and fetched on the host, installed offline
    nodeversion.py which Node it asks for: .nvmrc, .node-version, engines.node, else its CI's setup-node
    tapplugins.py  tap 18+'s plugins its tap config names and its lock lacks: fetched and built into tap
    wheels.py     the wheels for the image's Python, downloaded on the host (sdists are built in the container)
    toolchain.py  a project that compiles: its toolchain image and its in-place build
    debian.py     what the image's Debian release has: its own apt lists, fetched by the host's apt
    proof.py      the build's own check: the project imports, its tests collect
    build.py      the build container, the image committed once per dependency state, and `image_for`: the
                  builder a task's image comes from (its recipe, else what its repository declares)
    recipe.py     a task's environment recipe (Debian packages, root commands) as a `docker build`
    testbed.py    an offline SWE-bench instance image (/testbed from a release sdist, a `testbed` venv, conda's
                  activate as a shim), built in the same build container
    catalogue.py  the one label scheme every builder's image carries, read to list and prune them

`fix`, `eval run` / `grade` and `eval images` (the SWE-bench testbed) all build through this package.
"""
