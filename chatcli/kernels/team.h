/* The team of threads a kernel's loops share: OpenMP where the build has it, else a small
 * pool of POSIX threads of our own.
 *
 * Owns: team_run (fn(arg) on `threads` threads at once, the caller one of them), TEAM_FOR
 * (a loop over 0..n-1 whose iterations the team's threads split in contiguous shares, as
 * OpenMP's schedule(static) does, every thread waiting at its end for the others) and
 * team_procs (the machine's cores). Knows nothing about what the loops compute.
 *
 * Why a pool of our own: a compiler without OpenMP (Apple clang; clang without libomp) left
 * the kernels on one thread, and a decode step is a stream of weights that one core of a
 * laptop reads at well under the memory's speed. build.py builds with -fopenmp only where a
 * test program says the compiler has it and links GCC's libgomp (the runtime torch loads
 * on Linux: one OpenMP runtime in the process); elsewhere this pool. A step meets at ~10
 * barriers a layer, so the pool's threads spin at a barrier and for a while between calls
 * (as libgomp's do) before they sleep. One caller's team at a time: a second thread that
 * calls while the pool works runs its call alone on its own thread, which gives the same
 * answer (shares of a loop change who computes an iteration, never what it computes).
 * Each kernel source is its own library, so each has its own pool.
 */
#ifndef CHATCLI_TEAM_H
#define CHATCLI_TEAM_H

#ifdef _OPENMP
#include <omp.h>

#define TEAM_FOR(i, n) _Pragma("omp for schedule(static)") for (long i = 0; i < (n); i++)

static inline void team_run(int threads, void (*fn)(void *), void *arg) {
#pragma omp parallel num_threads(threads)
    fn(arg);
}

/* Asked once: libgomp asks the kernel for the affinity mask on every call. */
static inline long team_procs(void) {
    static long procs = 0;
    if (!procs) procs = omp_get_num_procs();
    return procs;
}

#else
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <strings.h>
#include <unistd.h>

#define TEAM_MAX 256
/* Spins before a waiting thread yields its core (a barrier) or sleeps (between calls); a
 * hundred where OMP_WAIT_POLICY=PASSIVE asks threads not to spin (cores shared with other
 * busy work), as libgomp's threads obey it. */
#define TEAM_SPINS 20000
#define TEAM_PASSIVE_SPINS 100
static long team_spins = TEAM_SPINS;

static struct {
    pthread_mutex_t busy;       /* held by the caller whose team runs */
    pthread_mutex_t lock;       /* guards the fields a sleeping worker waits on */
    pthread_cond_t wake;
    long started;               /* worker threads made so far (ids 1..started) */
    atomic_long generation;     /* bumped for each call: a worker's cue */
    atomic_long running;        /* the team's workers yet to finish fn */
    atomic_long arrived;        /* at the barrier */
    atomic_long sense;          /* flips as each barrier opens */
    int size;
    void (*fn)(void *);
    void *arg;
} team = {
    .busy = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
};

static __thread int team_id = 0, team_size = 1;
static __thread long team_sense = 0;

static inline void team_pause(long *spins) {
    if (++*spins > team_spins) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#elif defined(__aarch64__)
    else __asm__ __volatile__("yield");
#endif
}

/* Every thread of the team waits here until all have come. Returns 0 (TEAM_FOR's test). */
static int team_wait(void) {
    if (team_size == 1) return 0;
    long sense = !team_sense;
    team_sense = sense;
    if (atomic_fetch_add(&team.arrived, 1) == team_size - 1) {
        atomic_store(&team.arrived, 0);
        atomic_store(&team.sense, sense);
    } else {
        long spins = 0;
        while (atomic_load(&team.sense) != sense) team_pause(&spins);
    }
    return 0;
}

/* This thread's share of 0..n-1: the first n % size threads one more, as schedule(static). */
static inline long team_from(long n) {
    long q = n / team_size, r = n % team_size;
    return team_id * q + (team_id < r ? team_id : r);
}
static inline long team_to(long n) { return team_from(n) + n / team_size + (team_id < n % team_size); }

/* The loop's test runs team_wait once, when this thread's share is done. */
#define TEAM_FOR(i, n)                                                                         \
    for (long i = team_from(n), i##_end = team_to(n); i < i##_end || team_wait(); i++)

/* The generation each worker was made at: its first cue is the next one. Read from here, not
 * from team.generation when the thread starts, which may already count the call it serves. */
static long team_born[TEAM_MAX];

static void *team_worker(void *arg) {
    int id = (int)(long)arg;
    long seen = team_born[id];
    for (;;) {
        long spins = 0, now;
        while ((now = atomic_load(&team.generation)) == seen && spins < team_spins)
            team_pause(&spins);
        if (now == seen) {
            pthread_mutex_lock(&team.lock);
            while ((now = atomic_load(&team.generation)) == seen) pthread_cond_wait(&team.wake, &team.lock);
            pthread_mutex_unlock(&team.lock);
        }
        seen = now;
        if (id >= team.size) continue;
        team_id = id, team_size = team.size, team_sense = 0;
        team.fn(team.arg);
        atomic_fetch_sub(&team.running, 1);
    }
    return NULL;
}

/* A forked child has none of its parent's workers: it starts its own when it first calls. */
static void team_forked(void) {
    team.started = 0;
    pthread_mutex_init(&team.busy, NULL);
    pthread_mutex_init(&team.lock, NULL);
    pthread_cond_init(&team.wake, NULL);
}

static void team_run(int threads, void (*fn)(void *), void *arg) {
    if (threads > TEAM_MAX) threads = TEAM_MAX;
    if (threads <= 1 || pthread_mutex_trylock(&team.busy) != 0) {
        int id = team_id, size = team_size; /* alone: the caller is a team of one */
        team_id = 0, team_size = 1;
        fn(arg);
        team_id = id, team_size = size;
        return;
    }
    static int fork_handler = 0;
    if (!fork_handler) { /* the first call with a team: before any worker reads team_spins */
        fork_handler = !pthread_atfork(NULL, NULL, team_forked);
        const char *wait = getenv("OMP_WAIT_POLICY");
        if (wait && !strcasecmp(wait, "passive")) team_spins = TEAM_PASSIVE_SPINS;
    }
    while (team.started < threads - 1) {
        pthread_t thread;
        team_born[team.started + 1] = atomic_load(&team.generation);
        if (pthread_create(&thread, NULL, team_worker, (void *)(team.started + 1))) break;
        pthread_detach(thread);
        team.started++;
    }
    if (threads > team.started + 1) threads = (int)team.started + 1;
    team.size = threads, team.fn = fn, team.arg = arg;
    atomic_store(&team.arrived, 0);
    atomic_store(&team.sense, 0);
    atomic_store(&team.running, threads - 1);
    pthread_mutex_lock(&team.lock);
    atomic_fetch_add(&team.generation, 1);
    pthread_cond_broadcast(&team.wake);
    pthread_mutex_unlock(&team.lock);
    team_id = 0, team_size = threads, team_sense = 0;
    fn(arg);
    long spins = 0;
    while (atomic_load(&team.running) > 0) team_pause(&spins);
    team_id = 0, team_size = 1;
    pthread_mutex_unlock(&team.busy);
}

static inline long team_procs(void) {
    static long procs = 0;
    if (!procs) procs = sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN) : 1;
    return procs;
}

#endif

#endif
