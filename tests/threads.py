"""Running a test's work on several threads at once (the tests' shared helper)."""

import threading


def run_threads(n, work):
    """Run work(k) in n threads started together; re-raise the first error."""
    barrier, errors = threading.Barrier(n), []

    def body(k):
        try:
            barrier.wait()
            work(k)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
