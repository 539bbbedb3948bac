from pyinfra.operations import server

for number in range(200):
    server.shell(name=f"operation {number}", commands=["true"])
