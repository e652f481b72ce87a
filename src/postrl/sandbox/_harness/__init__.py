"""postrl sandbox harness: the trusted supervisor that runs INSIDE the sandbox.

The host (:mod:`postrl.sandbox.launch`) copies this package to a private folder, compiles it with the sandbox's
Python and starts ``python -I [-S] -c "<boot>" DIR REPORT_FD``, which imports :mod:`.main` (and with it every
module here, before anything is confined: the folder is not visible afterwards in namespaces mode) and calls
``main(REPORT_FD)`` with the run's spec on stdin (``<length>\\n<marshal blob>`` then a one-line nonce). It imports
only built-in modules (no json, re, enum, subprocess: interpreter start-up is most of a sandbox run's cost). It

1. confines itself where the host asked (:mod:`.confine`: the namespaces mode's isolation, or the fallback's
   reaper), drops to the sandbox uid when it starts as root (no-new-privs, bounding set cleared, not dumpable, so
   the program cannot read its memory or descriptors through /proc or ptrace) and loads the seccomp filter where
   bubblewrap did not;
2. runs the program in child processes (own session) under rlimits: address space, CPU seconds, file size,
   processes, open files, no core dumps (:mod:`.supervise`: a plain run and stdin/stdout cases; :mod:`.checker`:
   test functions and asserts, function-call cases);
3. reads the nonce only after every child has been started, and writes ONE JSON report, tagged with it, on
   REPORT_FD (a descriptor no program process holds). The host accepts nothing else as a result; text the program
   prints, whatever it looks like, is just output.

Modules: :mod:`.util` (helpers), :mod:`.confine`, :mod:`.supervise`, :mod:`.checker`, :mod:`.main`.
"""
