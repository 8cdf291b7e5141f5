#pragma once
// A TCP port on the loopback interface that was free a moment ago (for the rendezvous of test ranks).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace ferry::test {

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// A port in [lo, hi) on the loopback interface that was free a moment ago (tried from a random start).
inline int free_port_in(int lo, int hi) {
  const int span = hi - lo;
  const int start = static_cast<int>(::getpid()) % span;
  for (int k = 0; k < span; ++k) {
    const int port = lo + (start + k * 7919) % span;  // 7919 is prime: every port of the span once
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (free) return port;
  }
  ADD_FAILURE() << "no free port in [" << lo << ", " << hi << ")";
  return lo;
}

}  // namespace ferry::test
