#pragma once
// A TCP port on the loopback interface that was free a moment ago (for the rendezvous of test ranks).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ferry::test {

// Binds a TCP socket to `port` on the loopback interface (0: any free one) and closes it; the port it
// got, or -1 when that one was taken.
inline int bind_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int got = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    got = ntohs(addr.sin_port);
  }
  ::close(fd);
  return got;
}

inline int free_port() {
  const int port = bind_loopback(0);
  EXPECT_GT(port, 0);
  return port;
}

// A port in [lo, hi) on the loopback interface that was free a moment ago (tried from a random start).
inline int free_port_in(int lo, int hi) {
  const int span = hi - lo;
  const int start = static_cast<int>(::getpid()) % span;
  for (int k = 0; k < span; ++k) {
    const int port = lo + (start + k * 7919) % span;  // 7919 is prime: every port of the span once
    if (bind_loopback(port) == port) return port;
  }
  ADD_FAILURE() << "no free port in [" << lo << ", " << hi << ")";
  return lo;
}

}  // namespace ferry::test
