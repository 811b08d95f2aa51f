// The CPU suites' check that a call throws fusemoe::Error whose message names what is wrong.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fusemoe/error.h"

namespace fusemoe {

inline void expect_error_mentioning(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected fusemoe::Error mentioning '" << needle << "', nothing thrown";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  }
}

}  // namespace fusemoe
