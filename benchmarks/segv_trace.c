// A native backtrace for a crash in a peer's compiled code, where the machine has no gdb:
//   gcc -shared -fPIC -O1 benchmarks/segv_trace.c -o /tmp/segv_trace.so -ldl
//   LD_PRELOAD=/tmp/segv_trace.so python3 ...
// On SIGSEGV, SIGBUS or SIGABRT it prints the faulting address, rip, rsp, the stack limit,
// the frames backtrace() finds, and the words on the stack that point into a shared
// library (when unwinding stops), each as library+offset (symbol+offset). v35 found
// KeOps' crash with it (keops_env.sh).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>
#include <sys/resource.h>
static void frame(void *p) {
  Dl_info i; memset(&i, 0, sizeof i);
  if (dladdr(p, &i) && i.dli_fname)
    fprintf(stderr, "  %p %s+0x%lx (%s+0x%lx)\n", p, i.dli_fname,
            (unsigned long)((char *)p - (char *)i.dli_fbase), i.dli_sname ? i.dli_sname : "?",
            i.dli_saddr ? (unsigned long)((char *)p - (char *)i.dli_saddr) : 0ul);
  else fprintf(stderr, "  %p ?\n", p);
}
static void handler(int sig, siginfo_t *si, void *ctx) {
  ucontext_t *uc = ctx;
  void *rip = (void *)uc->uc_mcontext.gregs[REG_RIP], *rsp = (void *)uc->uc_mcontext.gregs[REG_RSP];
  struct rlimit rl; getrlimit(RLIMIT_STACK, &rl);
  fprintf(stderr, "SEGV_TRACE sig %d addr %p rip %p rsp %p stack limit %ld\n", sig, si->si_addr, rip, rsp, (long)rl.rlim_cur);
  frame(rip);
  void *b[64]; int n = backtrace(b, 64);
  for (int k = 0; k < n; k++) frame(b[k]);
  // the words on the stack that point into code: a fallback when unwinding stops
  fprintf(stderr, "stack words:\n");
  void **s = (void **)rsp;
  for (int k = 0; k < 400; k++) { Dl_info i; if (dladdr(s[k], &i) && i.dli_fname && strstr(i.dli_fname, ".so")) frame(s[k]); }
  _exit(139);
}
__attribute__((constructor)) static void install(void) {
  static char alt[1 << 16]; stack_t ss = {.ss_sp = alt, .ss_size = sizeof alt};
  sigaltstack(&ss, 0);
  struct sigaction sa; memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler; sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0); sigaction(SIGBUS, &sa, 0); sigaction(SIGABRT, &sa, 0);
}
