// Stress glibc's mallopt(M_MMAP_THRESHOLD) and malloc_trim(0) against allocations in other threads (docs/scale.md):
//     gcc -O2 -pthread -o malloc_hammer tests/tools/malloc_hammer.c && ./malloc_hammer 3 30   # threads, seconds
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
static volatile int stop;
static void *work(void *arg) {
  unsigned s = (unsigned)(uintptr_t)arg; void *slot[256]; size_t sz[256]; memset(slot, 0, sizeof slot);
  unsigned long n = 0;
  while (!stop) {
    int k = rand_r(&s) & 255;
    if (slot[k]) { unsigned char *p = slot[k]; for (size_t j = 0; j < sz[k]; j += 97) if (p[j] != (unsigned char)k) { fprintf(stderr, "BAD CONTENT\n"); abort(); } free(p); }
    int r = rand_r(&s) % 100;
    sz[k] = r < 97 ? 8 + rand_r(&s) % 1024 : r < 100 ? 4096 + rand_r(&s) % (256 << 10) : (1 << 20) + rand_r(&s) % (40 << 20);
    slot[k] = malloc(sz[k]); memset(slot[k], k, sz[k]); n++;
  }
  return (void *)n;
}
int main(int argc, char **argv) {
  int nt = argc > 1 ? atoi(argv[1]) : 3, secs = argc > 2 ? atoi(argv[2]) : 20;
  pthread_t t[64]; for (int i = 0; i < nt; i++) pthread_create(&t[i], 0, work, (void *)(uintptr_t)(i + 1));
  time_t end = time(0) + secs; unsigned long calls = 0;
  while (time(0) < end) { mallopt(M_MMAP_THRESHOLD, (calls & 1) ? 64 << 20 : 128 << 10); malloc_trim(0); calls++; }
  stop = 1; unsigned long tot = 0; for (int i = 0; i < nt; i++) { void *r; pthread_join(t[i], &r); tot += (unsigned long)r; }
  printf("ok: %lu mallopt+malloc_trim pairs, %lu allocations in %d threads\n", calls, tot, nt);
  return 0;
}
