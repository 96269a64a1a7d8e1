from server.protocol import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_tenant_is_cache_salt_then_user_then_common():
    def tenant(**fields) -> str:
        return ChatCompletionRequest(model="m", messages=MESSAGES, **fields).tenant

    assert tenant() == ""
    assert tenant(user="alice") == "alice"
    assert tenant(user="alice", cache_salt="team-1") == "team-1"
