"""The harness of ``make compose-test``: the Docker Compose cluster of ``docker/`` run for real
(``compose_test.py``), and the short training each container runs (``train_check.py``)."""
