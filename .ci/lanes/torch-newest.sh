# Lane: the newest torch this machine's registry installs (2.14.1 here: pip is capped there) with the newest
# lightning / accelerate / transformers / peft / trl the registry offers (no pins), as a user installing today gets.
# Catches a torch release or a library release that breaks us (accelerate 1.16.0's prepare() did) before users do.
# bash .ci/lane torch-newest   (a fresh .venv-lane-torch-newest; its versions are printed before the tests)
TORCH_PIN="torch==2.14.1"
PINS=(lightning accelerate transformers peft trl)
# shellcheck source=.ci/lanes/_engine_tests.sh
source "$(dirname "${BASH_SOURCE[0]}")/_engine_tests.sh"
# shellcheck source=.ci/lanes/libs-newest.sh
LANE_TORCH="$TORCH_PIN"; source "$(dirname "${BASH_SOURCE[0]}")/libs-newest.sh"; TORCH_PIN="$LANE_TORCH"
TESTS=("${ENGINE_TESTS[@]}" $(printf '%s\n' "${TESTS[@]}" | grep -vxF -f <(printf '%s\n' "${ENGINE_TESTS[@]}")))
# libs-newest's arguments minus its --durations; its deselect of the 67 s compile test stays (not dropped silently)
PYTEST_ARGS=(-n 2 --dist loadfile --deselect tests/test_lightning_integration.py::test_async_checkpoints_and_compiled_model)
