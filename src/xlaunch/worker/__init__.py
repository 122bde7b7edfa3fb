"""What runs inside a worker process: joining the launch, running the function, leaving records.

Also what the caller and its workers share about the launch's processes: the launch folder they
write and read (`launch_dir`), and the process tree the caller ends as one (`process_tree`).
"""
