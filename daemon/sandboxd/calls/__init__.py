"""A call's life: admission, preparation, the run, the result, replay, workspace reservations and the janitor."""
